import os, torch
if not torch.cuda.is_available(): os.environ.setdefault("TRITON_INTERPRET", "1")   # Triton kernels run on CPU through the interpreter
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
