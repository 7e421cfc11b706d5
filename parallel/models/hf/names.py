"""The transformers backend's tensor names: each parameter of the model in memory -> the name a checkpoint holds it
under, as transformers itself writes and reads them.

transformers 5 may keep a tensor under one name in memory and another on disk (GPT-NeoX's head is `lm_head` in
memory, `embed_out` in every checkpoint): `save_pretrained` drops the tied copies of a parameter
(`remove_tied_weights_from_state_dict`: the one it keeps is the one `from_pretrained` ties the others to) and reverts
its conversion mapping (`revert_weight_conversion`); `from_pretrained` does the opposite. The backend asks those
same two functions, on meta stand-ins, for every parameter's checkpoint name. A conversion that does more than
rename (a checkpoint's experts one tensor each, stacked into one on load) has no one-to-one reading, which the
backend's sliced loader needs: `checkpoint_names` then says why (a 422 at submit).

Reading, a checkpoint may spell a parameter otherwise (`Names.spellings`): under another name of a tied parameter,
or under its name in memory (a directory written without the conversion reverted).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(frozen=True)
class Names:
    spellings: dict[str, tuple[str, ...]] = field(default_factory=dict)
    """Each parameter (as `named_parameters` lists it: a tied one once) -> every name a checkpoint may hold it
    under, first the one save_pretrained writes."""


def checkpoint_names(hf: Any) -> tuple[Names, str | None]:
    """The parameters' checkpoint names and None when transformers only renames; (Names(), why) when its
    checkpoint format converts tensors on load."""
    from transformers.core_model_loading import revert_weight_conversion
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    every = dict(hf.named_parameters(remove_duplicate=False))
    stand_ins = {name: torch.empty(p.shape, device="meta") for name, p in every.items()}
    try:
        kept = remove_tied_weights_from_state_dict(dict(stand_ins), hf)
        renamed = _renamed(revert_weight_conversion(hf, dict(stand_ins)), stand_ins)
    except Exception as e:  # noqa: BLE001 - transformers' own error, named for the user
        return Names(), f"transformers cannot say its checkpoint names: {e!r}"
    if isinstance(renamed, str):
        return Names(), renamed
    names_of: dict[int, list[str]] = {}
    for name, p in every.items():
        names_of.setdefault(id(p), []).append(name)
    spellings = {}
    for names in names_of.values():  # a tied parameter's names, the one named_parameters lists first
        main = next((n for n in names if n in kept), names[0])
        spellings[names[0]] = tuple(dict.fromkeys([renamed[main], *(renamed[n] for n in names), *names]))
    return Names(spellings), None


def _renamed(reverted: dict[str, torch.Tensor], stand_ins: dict[str, torch.Tensor]) -> dict[str, str] | str:
    """Each name -> its checkpoint name, from what `revert_weight_conversion` made of the stand-ins; why not, when
    it made new tensors of them (a conversion beyond renaming)."""
    name_of = {id(t): name for name, t in stand_ins.items()}
    renamed = {name_of[id(t)]: key for key, t in reverted.items() if id(t) in name_of}
    converted = sorted(key for key, t in reverted.items() if id(t) not in name_of)
    if not converted and renamed.keys() == stand_ins.keys():
        return renamed
    example = converted[0] if converted else sorted(stand_ins.keys() - renamed.keys())[0]
    return (f"its checkpoints hold tensors transformers converts as it loads them (e.g. {example}, one of "
            f"{len(converted)} checkpoint tensors that are no one parameter of the model in memory), which the "
            "backend's sliced loader cannot read one to one")
