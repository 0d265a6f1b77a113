"""Fine-tuning inside the serving process: training data, LoRA adapters, the training loop, jobs and their API."""
