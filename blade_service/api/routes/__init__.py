"""One router per domain; thin handlers: parse, call `persistence`, commit, shape the answer."""
