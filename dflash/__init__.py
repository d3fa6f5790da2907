"""dflash: train DFlash speculative-decoding drafters against a frozen target model."""

__version__ = "0.1.0"
