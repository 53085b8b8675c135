"""The `pdserve` command line and the benchmarks: the top layer, which may import every other.

`pdserve.cli` is the command; `pdserve.bench` holds one module per `pdserve bench` command;
`pdserve.trace_sink` is the local OTLP receiver (`pdserve trace-sink`). docs/ARCHITECTURE.md
says where everything else lives.
"""
