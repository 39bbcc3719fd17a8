"""Reports: tables for the terminal (rich), JSON via the report objects' to_json()."""
