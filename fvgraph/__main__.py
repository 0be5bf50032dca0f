from fvgraph.cli import app

app(prog_name="fvgraph")
