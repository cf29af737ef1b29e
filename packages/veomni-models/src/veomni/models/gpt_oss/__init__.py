"""GPT-OSS adapter: the patch config, its generated modeling file and the experts claim (``experts.py``)."""
