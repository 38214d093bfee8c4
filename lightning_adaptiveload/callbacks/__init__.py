"""Lightning callbacks of the suite, one module each."""
from lightning_adaptiveload.callbacks.monitor import LoadBalanceMonitor
from lightning_adaptiveload.callbacks.calibration import CostModelCalibration
from lightning_adaptiveload.callbacks.checkpointing import PerBucketCheckpointing
from lightning_adaptiveload.callbacks.surgery import FusedAdaLNSurgery
from lightning_adaptiveload.callbacks.attention import AttentionBackends
from lightning_adaptiveload.callbacks.compile_cache import CompileCache
