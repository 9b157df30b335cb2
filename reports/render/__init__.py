"""One report shape, rendered once: a product builds a :class:`~reports.render.document.Document` (sections
of text, tables and figures) and :func:`~reports.render.html.to_html` and
:func:`~reports.render.markdown.to_markdown` render it, so the page and the Markdown of a product always
say the same thing. A section marked ``markdown=False`` (the page's long tables, its glossary) is left
out of the Markdown, which stays short enough for a CI log or a pull request."""
