"""The parts a run is made of: its config and the rules the config alone decides, the process layout (torchrun, the
(dp, tp) mesh, FSDP2/DDP), device placement, LoRA students, the optimizer, interrupts."""
