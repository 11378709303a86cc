"""Interleave several datasets so that every prefix of the stream follows the given weights."""
import numpy as np
import torch


def build_blending_indices(weights, size):
    """For each of `size` samples pick the dataset furthest behind its share (first one on ties);
    returns (dataset index per sample, sample index within that dataset)."""
    weights = [float(w) for w in weights]
    drawn = [0] * len(weights)
    dataset_index = np.empty(size, dtype=np.uint8)
    dataset_sample_index = np.empty(size, dtype=np.int64)
    for i in range(size):
        target = max(i, 1.0)
        best, best_error = 0, weights[0] * target - drawn[0]
        for d in range(1, len(weights)):
            error = weights[d] * target - drawn[d]
            if error > best_error:
                best, best_error = d, error
        dataset_index[i] = best
        dataset_sample_index[i] = drawn[best]
        drawn[best] += 1
    return dataset_index, dataset_sample_index


class BlendableDataset(torch.utils.data.Dataset):
    def __init__(self, datasets, weights):
        if len(datasets) != len(weights) or not datasets:
            raise ValueError(f"need one weight per dataset, got {len(datasets)} datasets and {len(weights)} weights")
        if len(datasets) > 255:
            raise ValueError("at most 255 datasets can be blended")
        weights = np.asarray(weights, dtype=np.float64)
        if weights.sum() <= 0 or weights.min() < 0:
            raise ValueError(f"blend weights must be non-negative with a positive sum, got {weights.tolist()}")
        self.datasets = datasets
        self.weights = weights / weights.sum()
        self.size = sum(len(d) for d in datasets)
        self.dataset_index, self.dataset_sample_index = build_blending_indices(self.weights, self.size)

    def __len__(self):
        return self.size

    def __getitem__(self, idx):
        return self.datasets[self.dataset_index[idx]][self.dataset_sample_index[idx]]
