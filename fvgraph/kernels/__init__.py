"""Custom ops the -O3 quantize pass puts in the compiled graph (FP8 linear, norm + modulation + FP8
quantization), each beside a plain-torch reference, with Triton where it helps; and the SDPA backend
choice the compiler applies (attention.py)."""
