"""The families' shared parts (torchtitan's `components/`): what a family's stage is built from, which no family
owns alone.

Owns the decoder stage every native family builds (`decoder`: `DecoderStage`, blocks keyed by global index), packed
data's documents and their attention (`documents`), the mixture-of-experts layer and expert parallelism (`moe`) with
its grouped matmul (`grouped`), the loss fused with the output projection (`loss`), LoRA's adapters on a built stage
(`lora`), the pieces of a family's tensor-parallel plan (`tp_styles`), host data on its way to the device
(`transfers`) and the Hugging Face state-dict adapter's common part (`hf_mapping`). Imports no family: the families
import these, and a part reaches a family only through the registry (`parallel.models.family_of`).
"""
