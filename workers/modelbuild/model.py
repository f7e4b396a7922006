"""The demo lane-offset regressor: a fixed, seeded conv feature extractor + a linear head
fitted by ridge least squares on synthetic frames.

    input  float32[1, 1, 64, 128]  (Y plane, cropped/area-averaged/normalised, see
                                    workers.modeld.engine.preprocess_y)
    conv1  3x3, 1->8, pad 1, ReLU   filters: Sobel-x, -Sobel-x, Sobel-y, -Sobel-y,
                                    Laplacian, -Laplacian, 2 seeded random
    pool   2x2 mean                 -> 8 x 32 x 64
    conv2  3x3, 8->16, pad 1, ReLU  seeded He-normal weights, seeded small biases
    pool   8x4 mean                 -> 16 x 4 x 16 = 1024 features
    head   1024 -> 2 linear         fitted at build time: (offset_m, heading_rad)
                                    (two cameras, input ABI 3: 2048 -> 2, the same trunk
                                    on each, features side by side)
    conf   sigmoid(k * (E - e0))    E = mean of the two Sobel-x channels (lane-edge energy);
                                    k, e0 calibrated at build time (no edges -> ~0)
    output float32[4] = (offset_m, heading_rad, confidence, 0)

Nothing is trained by gradient descent; every weight is a deterministic function of the
seed and the training frames.
"""
from __future__ import annotations

import numpy as np

N_FEATURES = 16 * 4 * 16


def conv_weights(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng([seed, 0xC0DE])
    sx = np.array([[-1, 0, 1], [-2, 0, 2], [-1, 0, 1]], np.float32) / 4
    lap = np.array([[0, 1, 0], [1, -4, 1], [0, 1, 0]], np.float32) / 4
    k1 = [sx, -sx, sx.T.copy(), -sx.T, lap, -lap]
    k1 += [(rng.standard_normal((3, 3)) / 3).astype(np.float32) for _ in range(2)]
    w1 = np.stack(k1)[:, None].astype(np.float32)
    b1 = np.zeros(8, np.float32)
    w2 = (rng.standard_normal((16, 8, 3, 3)) * np.sqrt(2 / 72)).astype(np.float32)
    b2 = (rng.standard_normal(16) * 0.05).astype(np.float32)
    return {"w1": w1, "b1": b1, "w2": w2, "b2": b2}


class LaneNet:
    """tinygrad graph builders over fixed weights (import tinygrad before using)."""

    def __init__(self, weights: dict[str, np.ndarray], device: str = "CPU") -> None:
        from tinygrad import Tensor

        self.np = weights
        self.t = {k: Tensor(np.ascontiguousarray(v), device=device).realize()
                  for k, v in weights.items()}
        self.device = device

    def _trunk(self, x):
        t = self.t
        h1 = x.conv2d(t["w1"], t["b1"], padding=1).relu()
        h = h1.avg_pool2d(2)
        h = h.conv2d(t["w2"], t["b2"], padding=1).relu()
        h = h.avg_pool2d((8, 4))
        energy = h1[:, 0:2].mean(axis=(1, 2, 3))
        return h.reshape(x.shape[0], -1), energy

    def features(self, x):
        """[B, 1, 64, 128] -> ([B, 1024] features, [B] edge energy)."""
        return self._trunk(x)

    def forward(self, x, *more):
        """[1, 1, 64, 128] per camera -> float32[4]; needs head_w [1024 * cameras, 2],
        head_b [2], conf_k, conf_e0. Several cameras (input ABI 3): each through the same
        trunk, features side by side; the confidence is the first camera's."""
        t = self.t
        f, energy = self._trunk(x)
        if more:
            f = f.cat(*[self._trunk(m)[0] for m in more], dim=1)
        y = f.matmul(t["head_w"]) + t["head_b"]
        if getattr(self, "clip01", False):      # probabilities (the driver model's head)
            y = y.clip(0.0, 1.0)
        conf = ((energy - t["conf_e0"]) * t["conf_k"]).sigmoid()
        # reserved = 0 by padding (fused, no extra kernel)
        return y.reshape(2).cat(conf.reshape(1)).pad(((0, 1),)).contiguous()


def fit_head(F: np.ndarray, T: np.ndarray, lam: float) -> tuple[np.ndarray, np.ndarray]:
    """Ridge least squares on standardised features, folded back: T ~ F @ W + b."""
    F = F.astype(np.float64)
    mu, sd = F.mean(0), F.std(0)
    # Floor the scale: a feature (nearly) constant in training (sky, borders) must not
    # be blown up to unit variance, or its noise gets a huge weight.
    sd = np.maximum(sd, 0.05 * float(np.median(sd)) + 1e-6)
    A = np.hstack([(F - mu) / sd, np.ones((len(F), 1))])
    reg = lam * np.eye(A.shape[1])
    reg[-1, -1] = 0.0
    Wb = np.linalg.solve(A.T @ A + reg, A.T @ T.astype(np.float64))
    W = Wb[:-1] / sd[:, None]
    b = Wb[-1] - (mu / sd) @ Wb[:-1]
    return W.astype(np.float32), b.astype(np.float32)
