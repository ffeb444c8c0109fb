"""KV-cache methods: how K/V are stored and how attention reads them."""
