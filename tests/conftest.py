import os, torch
if not torch.cuda.is_available(): os.environ.setdefault("TRITON_INTERPRET", "1")   # Triton kernels run on CPU through the interpreter
# under pytest-xdist each worker gets an equal share of the cores (two workers on two cores: one thread each)
_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(max(1, min(2, (os.cpu_count() or 1) // _workers)))
