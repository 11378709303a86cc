"""Import-time stand-in for torchvision, for launching upstream Megatron-DeepSpeed on CPU in tests only.

Upstream's megatron/training.py imports megatron.model.vision.knn_monitor, which imports
megatron/data/vit_dataset.py and image_folder.py, which import torchvision at module level. A PyPI
torchvision cannot be installed beside this CPU torch, and GPT training never uses it: these modules
only have to import. Anything that really uses torchvision fails loudly (AttributeError).
"""
