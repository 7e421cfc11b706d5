"""The mistral family (Hugging Face `MistralForCausalLM`): llama's shape with an optional sliding window
(`model.sliding_window`: each position attends to itself and the window - 1 positions before it).

The window is a mask in llama's attention (`parallel.models.llama.layers.LlamaAttention`), over the whole
sequence each rank holds there: with sp the attention's input is all-gathered first, and a pipeline stage
holds whole sequences, so it composes with sp and pp as it is. Everything else is llama's.
"""

from __future__ import annotations

from trainyard.parallel.models.llama import Llama


class Mistral(Llama):
    name = "mistral"
    SLIDING_WINDOW = True
