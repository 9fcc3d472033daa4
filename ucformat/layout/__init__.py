"""Pure layout math: ZeRO partitions, interval algebra and chunk shapes. No I/O anywhere here."""
