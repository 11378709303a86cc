"""`from torchvision.datasets import VisionDataset` (upstream image_folder.py) needs a class to subclass."""


class VisionDataset:
    pass
