"""Patch whitening: initialize the first conv from the data so that its filters
decorrelate the input's patches (the CIFAR-10 speedruns' first layer)."""
import torch
from torch import nn


@torch.no_grad()
def whiten_first_conv(conv: nn.Conv2d, images: torch.Tensor, eps: float = 5e-4):
    """Set conv's filters to the eigenvectors of the covariance of images' patches, scaled
    by 1/sqrt(eigenvalue + eps), each with its negation (so a following GELU keeps both
    signs); the largest components first. Filters beyond 2*c*kh*kw keep their init."""
    c, (kh, kw) = images.shape[1], conv.kernel_size
    patches = images.float().unfold(2, kh, 1).unfold(3, kw, 1).transpose(1, 3).reshape(-1, c * kh * kw)
    covariance = patches.T @ patches / patches.shape[0]
    eigenvalues, eigenvectors = torch.linalg.eigh(covariance)
    eigenvalues, eigenvectors = eigenvalues.flip(0), eigenvectors.T.flip(0).reshape(-1, c, kh, kw)
    scaled = eigenvectors / torch.sqrt(eigenvalues.clamp(min=0) + eps).view(-1, 1, 1, 1)
    filters = torch.cat([scaled, -scaled])[:conv.out_channels]
    conv.weight[:len(filters)] = filters.to(conv.weight.dtype)
