"""`import torchvision.transforms as T` (upstream vit_dataset.py) only; GPT never builds a transform."""
