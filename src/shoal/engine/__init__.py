"""The background engine: request queue -> negotiation -> fusion -> execution -> completed handles."""
