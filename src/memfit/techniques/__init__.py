"""Memory techniques: one module each, a frozen Config and an ``apply`` acting on a plain module,
optimizer or step. A disabled technique is a do-nothing object, not an ``if enabled:`` at each
call site."""
