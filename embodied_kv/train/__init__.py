"""Training the VLA on the synthetic world (torch): tokenizer, batches, losses, loop."""
