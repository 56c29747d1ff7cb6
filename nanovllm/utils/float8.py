"""e4m3, the float8 format of FP8 weights and of an FP8 KV cache."""

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
