"""DAD layers: a trainer-driven layer, an autograd drop-in for ``nn.Linear`` and an LM head."""
