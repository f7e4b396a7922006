"""The research shadow model: a tiny lane-offset estimator on NV12 road frames.

Torch lives here and only here (the research domain). Control workers must never
import this module; the admission checker walks their import graphs.

The weights are not trained: they are drawn from a seeded ``torch.Generator`` so that
the same seed gives bit-identical weights in every process (the worker and a test
recomputing its outputs). Swap in trained weights with ``LaneNet.load_state_dict``.

Input: Y plane (h, w) uint8 and interleaved UV plane (h/2, w/2, 2) uint8, any even size.
Both are scaled to [-0.5, 0.5] and area-averaged to ``INPUT_HW``; the three channels
(Y, U, V) go through three strided 3x3/5x5 convolutions, a 2x4 average pool and a
linear head with four outputs (`OUTPUTS`).
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

INPUT_HW = (96, 160)
OUTPUTS = ("lane_offset_m", "heading_rad", "left_line_prob", "right_line_prob")


class LaneNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(3, 8, 5, stride=2, padding=2)
        self.c2 = nn.Conv2d(8, 16, 3, stride=2, padding=1)
        self.c3 = nn.Conv2d(16, 32, 3, stride=2, padding=1)
        self.head = nn.Linear(32 * 2 * 4, len(OUTPUTS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.c1(x))
        x = F.relu(self.c2(x))
        x = F.relu(self.c3(x))
        x = F.adaptive_avg_pool2d(x, (2, 4)).flatten(1)
        raw = self.head(x)
        return torch.stack([2.0 * torch.tanh(raw[:, 0]), 0.5 * torch.tanh(raw[:, 1]),
                            torch.sigmoid(raw[:, 2]), torch.sigmoid(raw[:, 3])], dim=1)


def build_model(seed: int = 0) -> LaneNet:
    """The model with deterministic weights from ``seed`` (He-normal weights, small
    biases), independent of torch's global RNG and of its default initialisers."""
    model = LaneNet()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.01)
            else:
                fan_in = p[0].numel()
                p.copy_(torch.randn(p.shape, generator=g) * (2.0 / fan_in) ** 0.5)
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def preprocess(y: torch.Tensor, uv: torch.Tensor) -> torch.Tensor:
    """(h, w) uint8 Y and (h/2, w/2, 2) uint8 UV -> (1, 3, *INPUT_HW) float32 in
    [-0.5, 0.5]. Area-average first, scale after (they commute; the scaling then touches
    96x160 values instead of every pixel)."""
    yf = F.adaptive_avg_pool2d(y.to(torch.float32)[None, None], INPUT_HW)
    uvf = F.adaptive_avg_pool2d(uv.permute(2, 0, 1).to(torch.float32)[None], INPUT_HW)
    return torch.cat([yf, uvf], dim=1).mul_(1.0 / 255.0).sub_(0.5)


def infer(model: LaneNet, y: torch.Tensor, uv: torch.Tensor) -> np.ndarray:
    """float32[4] (`OUTPUTS`) for one frame. ``y`` and ``uv`` must be tensors the caller
    owns (never views of shared memory another process may rewrite)."""
    with torch.inference_mode():
        return model(preprocess(y, uv))[0].numpy().astype(np.float32, copy=True)


def infer_numpy(model: LaneNet, y: np.ndarray, uv: np.ndarray) -> np.ndarray:
    """Reference path for tests and offline replay: copies the planes, then `infer`."""
    return infer(model, torch.from_numpy(np.array(y, np.uint8, copy=True)),
                 torch.from_numpy(np.array(uv, np.uint8, copy=True)))
