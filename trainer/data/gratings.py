"""Generated images: oriented, colored stripes under noise (the synthetic data set's and the
JPEG tree tool's). Orientation and color are what tell one class from another."""
from concurrent.futures import ThreadPoolExecutor

import numpy as np

NOISE = 0.2  # pixel noise (std, 0..1 scale): fastnet_tiny's default run gets ~11% after one step, 97-99.7% after 4 epochs
_JITTER = 0.15  # radians, of orientation and hue
_AMPLITUDE = (0.28, 0.5)  # of the color swing, on a 0..1 scale
_PERIOD = (4.0, 8.0)  # stripe period in pixels of a 16-pixel image; scales with the image
ORIENTATIONS = np.array([0, np.pi / 2])  # horizontal and vertical stripes: each its own mirror image
_RED_GREEN, _BLUE_YELLOW = np.array([1, -1, 0]) / np.sqrt(2), np.array([1, 1, -2]) / np.sqrt(6)
_CHUNK_PIXELS = 2**19  # images are made this many pixels at a time, in float32: a few MB a thread


def hues(n: int) -> np.ndarray:
    """n stripe colors, as angles of color axes through gray in the chromatic plane, evenly
    spread over half the circle: an axis and its negative are one color (the stripes'
    phase shifted by half a period)."""
    return np.arange(n) * np.pi / n


def gratings(theta: np.ndarray, hue: np.ndarray, rng: np.random.Generator, height: int, width: int,
             noise: float = NOISE, threads: int = 1) -> np.ndarray:
    """uint8 (n, height, width, 3) images: sinusoidal stripes at angle theta[i] whose color
    swings along hue[i] around a near-gray background, with jitter of both and Gaussian
    pixel noise. Made on `threads` threads; the images do not depend on how many."""
    n = len(theta)
    theta = theta + rng.uniform(-_JITTER, _JITTER, n)
    hue = hue + rng.uniform(-_JITTER, _JITTER, n)
    axis = np.cos(hue)[:, None] * _RED_GREEN + np.sin(hue)[:, None] * _BLUE_YELLOW
    period = rng.uniform(*_PERIOD, n) * min(height, width) / 16
    phase = rng.uniform(0, 2 * np.pi, n)
    y = np.arange(height, dtype=np.float32)[None, :, None]
    x = np.arange(width, dtype=np.float32)[None, None, :]
    k = 2 * np.pi / period
    kx, ky = ((k * f(theta)).astype(np.float32)[:, None, None] for f in (np.cos, np.sin))
    phase = phase.astype(np.float32)[:, None, None]
    amplitude = (rng.uniform(*_AMPLITUDE, n)[:, None] * axis).astype(np.float32)[:, None, None, :]
    background = rng.uniform(0.4, 0.6, (n, 1, 1, 3)).astype(np.float32)  # near gray, a faint cast
    # each image's pixel noise is its own stream, so that chunks on threads draw it in any order
    noise_rngs = rng.spawn(n)
    out = np.empty((n, height, width, 3), np.uint8)
    step = max(1, _CHUNK_PIXELS // (height * width))

    def make(i: int):
        # a chunk at a time, so that 224x224 images are made at memory speed, not through
        # GB of float64 temporaries; numpy's loops and draws release the GIL
        s = slice(i, i + step)
        img = background[s] + np.sin(kx[s] * x + ky[s] * y + phase[s])[..., None] * amplitude[s]
        pixel_noise = np.empty_like(img)
        for j, g in enumerate(noise_rngs[s]):
            g.standard_normal(dtype=np.float32, out=pixel_noise[j])
        img += pixel_noise * np.float32(noise)
        out[s] = np.rint(np.clip(img, 0, 1, out=img) * np.float32(255))

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(make, range(0, n, step)))
    return out
