"""dmfx's fused operators (torch.library, namespace ``dmfx::``) and the build of their CPU/CUDA kernels."""
