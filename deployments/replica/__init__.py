"""An engine replica: one engine per Serve replica, spoken to in token ids."""
