"""The routing-table contract between the operator (writer) and the proxy (reader).

Depends on nothing else in pdserve but pdserve.kv (which connector types a table may name and
what their instances carry): the operator, the local mode and the proxy all import it.
"""

from pdserve.routing.slots import (
    Slot,
    SlotTable,
    Unpaired,
    build_slot_table,
    interleaved_slots,
    slot_key,
    split_slot_key,
)
from pdserve.routing.table import (
    API_VERSION,
    CONFIGMAP_KEY,
    KIND,
    Connector,
    Endpoint,
    FieldError,
    Instance,
    Role,
    RoutingTable,
    RoutingTableError,
    load_routing_table,
    parse_routing_table,
)

__all__ = [
    "API_VERSION",
    "CONFIGMAP_KEY",
    "KIND",
    "Connector",
    "Endpoint",
    "FieldError",
    "Instance",
    "Role",
    "RoutingTable",
    "RoutingTableError",
    "Slot",
    "SlotTable",
    "Unpaired",
    "build_slot_table",
    "interleaved_slots",
    "load_routing_table",
    "parse_routing_table",
    "slot_key",
    "split_slot_key",
]
