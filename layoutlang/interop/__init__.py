"""Reading and writing other formats: Hugging Face configs, safetensors, DTensor."""
