"""Token-level finetuning: forward windows, layer-wise backward windows, and the trainer around them."""
