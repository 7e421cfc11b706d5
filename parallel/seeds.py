"""Seeds derived from the job seed and a name, so no random stream depends on the layout or the rank."""

import hashlib


def derive_seed(seed: int, *keys: object) -> int:
    """A 63-bit seed for torch.Generator from the job seed and any keys (a parameter name, a step)."""
    digest = hashlib.sha256("/".join(map(str, (seed, *keys))).encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)
