"""The transformers backend's tensor names: each parameter of the model in memory -> its name in a checkpoint, as
transformers itself writes and reads them.

transformers 5 may keep a tensor under one name in memory and another on disk (GPT-NeoX's head is `lm_head` in
memory, `embed_out` in every checkpoint): `save_pretrained` reverts its conversion mapping
(`transformers.core_model_loading.revert_weight_conversion`) and `from_pretrained` applies it. The backend asks
that same function, on meta stand-ins, for every parameter's checkpoint name. A conversion that does more than
rename (a checkpoint's experts one tensor each, stacked into one on load) has no one-to-one reading, which the
backend's sliced loader needs: `checkpoint_names` then says why (a 422 at submit).

Tied parameters: a model ties through its own `tie_weights` (the head is the embedding's Parameter); a tied
parameter is one parameter (listed once, under the name `named_parameters` gives it), and its other names
(`tied_names`) are names a checkpoint may also hold and the loader leaves unread.
"""

from __future__ import annotations

from typing import Any

import torch


def checkpoint_names(hf: Any) -> tuple[dict[str, str], str | None]:
    """(each parameter's name -> its checkpoint name, None) when transformers only renames; ({}, why) when its
    checkpoint format converts tensors on load. Every name of a tied parameter is there."""
    from transformers.core_model_loading import revert_weight_conversion

    params = dict(hf.named_parameters(remove_duplicate=False))
    stand_ins = {name: torch.empty(p.shape, device="meta") for name, p in params.items()}
    try:
        reverted = revert_weight_conversion(hf, dict(stand_ins))
    except Exception as e:  # noqa: BLE001 - transformers' own error, named for the user
        return {}, f"transformers cannot say its checkpoint names: {e!r}"
    name_of = {id(t): name for name, t in stand_ins.items()}
    names = {name_of[id(t)]: key for key, t in reverted.items() if id(t) in name_of}
    converted = sorted(key for key, t in reverted.items() if id(t) not in name_of)
    if converted or names.keys() != params.keys():
        example = converted[0] if converted else sorted(params.keys() - names.keys())[0]
        return {}, (f"its checkpoints hold tensors transformers converts as it loads them (e.g. {example}, one of "
                    f"{len(converted)} checkpoint tensors that are no one parameter of the model in memory), which "
                    "the backend's sliced loader cannot read one to one")
    return names, None


def tied_names(hf: Any) -> dict[str, str]:
    """Each other name of a tied parameter -> the name it is listed under (`named_parameters`)."""
    first: dict[int, str] = {}
    other: dict[str, str] = {}
    for name, p in hf.named_parameters(remove_duplicate=False):
        if id(p) in first:
            other[name] = first[id(p)]
        else:
            first[id(p)] = name
    return other
