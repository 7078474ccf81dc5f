"""The Hugging Face layout: save_model, load_model, consolidate."""
