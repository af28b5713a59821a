"""Text generation without torch: settings, events, stop sequences, incremental decoding.

The API (`meshnet.api`), the tracker's forwarder and the terminal clients import these;
only the entry's generator loop (`meshnet.entry`) adds the model.
"""
