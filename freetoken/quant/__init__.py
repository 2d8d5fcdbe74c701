"""GGML block formats (the GGUF tensor types) and a quantizer into them, in numpy."""
