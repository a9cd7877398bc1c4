"""Is the network the bottleneck? Measurement, probing and what-if analysis of distributed steps.

Following Zhang et al., "Is Network the Bottleneck of Distributed Training?" (NetAI 2020): split a
step into compute and communication, measure how well the link is used, and predict the step at
other bandwidths, worker counts and compression ratios. Units everywhere: seconds, bytes, bits/s.

  python -m sparsejax.netanalysis --help
"""

from sparsejax.netanalysis.units import ProfileError
from sparsejax.rates import format_rate, parse_rate

__all__ = ["ProfileError", "format_rate", "parse_rate"]
