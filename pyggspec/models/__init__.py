"""Graph builders for the Qwen3.5 trunk (target) and its MTP head."""
