"""Test support: multi-rank gloo harness and tiny Megatron GPT builders."""
