"""An independent reference integrator: NumPy gradients + SciPy DOP853 (no JAX, no diffrax)."""

import numpy as np
from scipy.integrate import solve_ivp


def numpy_gradient(layers, target, mask):
    prefix = [np.eye(layers[0].shape[1])]
    for w in layers:
        prefix.append(w @ prefix[-1])
    residual = mask * (prefix[-1] - target)
    grads = [None] * len(layers)
    upstream = residual
    for i in range(len(layers) - 1, -1, -1):
        grads[i] = upstream @ prefix[i].T
        upstream = layers[i].T @ upstream
    return grads, 0.5 * np.sum(residual**2)


def reference_flow(layers, target, mask, t_end, rtol=1e-13, atol=1e-16):
    shapes = [w.shape for w in layers]
    sizes = [w.size for w in layers]

    def unpack(y):
        out, k = [], 0
        for shape, size in zip(shapes, sizes, strict=True):
            out.append(y[k : k + size].reshape(shape))
            k += size
        return out

    def rhs(t, y):
        grads, _ = numpy_gradient(unpack(y), target, mask)
        return -np.concatenate([g.ravel() for g in grads])

    y0 = np.concatenate([np.asarray(w, dtype=np.float64).ravel() for w in layers])
    sol = solve_ivp(rhs, (0.0, t_end), y0, method="DOP853", rtol=rtol, atol=atol)
    assert sol.success, sol.message
    end = unpack(sol.y[:, -1])
    _, loss = numpy_gradient(end, target, mask)
    return end, loss
