"""Pallas kernels, each with the signature of the reference it accelerates."""


def check_tile(kernel: str, name: str, size: int, backend: str, interpret: bool) -> None:
    """Raise naming the field when a tile size cannot run on this backend."""
    if interpret:
        ok, need = size >= 1, "a positive integer"
    elif backend == "gpu":
        ok, need = size >= 16 and size & (size - 1) == 0, "a power of two >= 16 on GPU (Triton)"
    elif backend == "tpu":
        ok, need = size % 128 == 0 and size > 0, "a multiple of 128 on TPU (Mosaic)"
    else:
        raise ValueError(f"the {kernel} Pallas kernel runs on GPU or TPU, or in interpret mode; "
                         f"backend {backend!r} needs interpret=True")
    if not ok:
        raise ValueError(f"{kernel} kernel {name}={size} is not usable: it must be {need}")
