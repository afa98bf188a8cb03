"""One module per resource, each an ``APIRouter`` that ``create_app`` includes."""
