"""Weight transfer: protocols that move HF-named tensors from trainer ranks to engines."""

from miles_core.weight_transfer.protocol import EngineEndpoint, TransferReport, WeightBucket, WeightTransferProtocol

__all__ = ["EngineEndpoint", "TransferReport", "WeightBucket", "WeightTransferProtocol"]
