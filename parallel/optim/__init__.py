"""The optimizer room: the registry of optimizer kinds (`kinds`: state bytes, build), Adafactor and torchao's 8-
and 4-bit AdamW (`low_bit`), each kind's state in the checkpoint's form (`states`), the learning-rate schedule and
global-norm clipping (`optimizer`). May import `parallel.config` only; `kinds` imports no torch at module level
(the plan reads it).
"""
