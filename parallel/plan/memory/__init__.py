"""The memory room: what each rank of a plan holds, estimated before it runs (`estimate`: parameters, gradients,
optimizer state, activations and buffers per rank, which admission checks against the devices), and what ZeRO-2/3's
FSDP2 units add to it (`fsdp`). Pure: no torch."""
