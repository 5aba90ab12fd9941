"""The torch.compile front-end: backend, graph splitting at attention ops, CUDA graph capture and
replay, fusion passes and the compile cache. Filled in by a later issue."""
