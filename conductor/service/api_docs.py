"""``GET /docs``: Swagger UI over ``/openapi.json``, its assets pinned to one version with integrity hashes.

FastAPI's own page loads ``swagger-ui-dist@5`` from a CDN: whatever version 5.x the CDN serves that day,
unchecked, on this API's origin, in a page where users paste their API key (the routes declare an
``Authorization`` header). A compromised or hijacked asset would run as this origin: it could call the API
with that key and read the trace viewer's pages with its session cookie. Here the browser loads exactly
``SWAGGER_UI_VERSION`` and refuses a file whose hash is not the one below (Subresource Integrity); no
favicon, font or ReDoc page is fetched from elsewhere, and the page sends no ``Referer``.

The hashes are those of the npm package's files (``npm pack swagger-ui-dist@VERSION``; the CDN serves them
unchanged): ``openssl dgst -sha384 -binary FILE | base64``. To upgrade, change the version and both hashes
together.
"""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import HTMLResponse

SWAGGER_UI_VERSION = "5.35.0"
SWAGGER_UI_BASE = f"https://cdn.jsdelivr.net/npm/swagger-ui-dist@{SWAGGER_UI_VERSION}"
SWAGGER_UI_JS_SRI = "sha384-gjRm0bEPMeTmMh5jT2cHccIwCUZSTd8YC+j0d0sXw0MdGEfScduGpSyF3ZSSLkX9"
SWAGGER_UI_CSS_SRI = "sha384-WlYgdmXYOOBWL5apwjDEZwN+U3HmXSSu5R6V5aGxEcf7z+KuRNwBhoxKVN1i3D5I"

PAGE = f"""<!DOCTYPE html>
<html>
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1.0">
<meta name="referrer" content="no-referrer">
<link rel="icon" href="data:,">
<link rel="stylesheet" href="{SWAGGER_UI_BASE}/swagger-ui.css" integrity="{SWAGGER_UI_CSS_SRI}" crossorigin="anonymous">
<title>Conductor Queue - API</title>
</head>
<body>
<div id="swagger-ui"></div>
<script src="{SWAGGER_UI_BASE}/swagger-ui-bundle.js" integrity="{SWAGGER_UI_JS_SRI}" crossorigin="anonymous"></script>
<script>
SwaggerUIBundle({{url: "/openapi.json", dom_id: "#swagger-ui", layout: "BaseLayout", deepLinking: true,
  showExtensions: true, showCommonExtensions: true,
  presets: [SwaggerUIBundle.presets.apis, SwaggerUIBundle.SwaggerUIStandalonePreset]}});
</script>
</body>
</html>
"""

router = APIRouter(include_in_schema=False)


@router.get("/docs", response_class=HTMLResponse)
def swagger_ui() -> HTMLResponse:
    # Not framed by another site (clickjacking "Try it out" with a key typed into Authorize), as the viewer's
    # pages are not; its own inline script is left alone (no other CSP directive).
    return HTMLResponse(PAGE, headers={"Referrer-Policy": "no-referrer", "X-Content-Type-Options": "nosniff",
                                       "Content-Security-Policy": "frame-ancestors 'none'",
                                       "X-Frame-Options": "DENY"})
