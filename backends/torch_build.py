"""What only an interpreter's torch knows of its CUDA build, printed as one JSON line: `harness env` and
`harness doctor --gpu` start it with the stack's interpreter (the harness imports no framework).

torch's version, whether it sees a GPU, the CUDA (or HIP) runtime, cuDNN and NCCL it was built with, and
the CUDA version the installed driver supports (libcuda's cuDriverGetVersion: the driver's, not the
toolkit's), so a driver older than the runtime shows before a run fails on it.
"""

import ctypes
import json

import torch


def unknown(exc: Exception) -> str:
    return f"unknown ({type(exc).__name__})"


def main() -> None:
    facts = {
        "torch": torch.__version__,
        "cuda_available": torch.cuda.is_available(),
        "cuda": torch.version.cuda,
        "hip": getattr(torch.version, "hip", None),
        "cudnn": None,
        "nccl": None,
        "driver_cuda": None,
    }
    if facts["cuda"] or facts["hip"]:
        try:
            facts["cudnn"] = torch.backends.cudnn.version()
        except Exception as exc:
            facts["cudnn"] = unknown(exc)
        try:
            facts["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception as exc:
            facts["nccl"] = unknown(exc)
    try:
        version = ctypes.c_int()
        ctypes.CDLL("libcuda.so.1").cuDriverGetVersion(ctypes.byref(version))
        facts["driver_cuda"] = f"{version.value // 1000}.{version.value % 1000 // 10}"
    except OSError:
        pass  # no driver here: a CPU machine
    print(json.dumps(facts))


if __name__ == "__main__":
    main()
