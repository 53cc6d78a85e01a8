"""flash-attn's kernel interface on CPU, for tests only (not installed, not shipped).

flash-attn cannot be built without CUDA, so ring-flash-attn's ring code could never run here. This
package gives it flash-attn's two private kernel entry points with flash-attn's signatures and
layouts ([batch, seq, heads, dim], log-sum-exp [batch, heads, seq] in fp32, gradients written into
the given buffers), computed by PyTorch's fused CPU attention kernels (through longsft's block
helpers). The tests put this folder on PYTHONPATH only for the processes that test the
``ring_flash_attn`` backend, so that ring-flash-attn's own zigzag forward, merge and backward run
unchanged against full attention.
"""

__version__ = "2.6.3"
