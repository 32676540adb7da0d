"""LoRA adapters: the user-facing request, PEFT folders (read and checked), and the engine core's
table of device slots. Beneath every layer (it imports only the base: config, protocol)."""
