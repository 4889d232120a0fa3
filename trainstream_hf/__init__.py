"""trainstream_hf: train models larger than GPU memory in the Hugging Face ecosystem."""
__version__ = "0.1.0"

