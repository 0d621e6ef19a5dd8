// The API docs' script (broker/service/api_docs.py): starts the Swagger UI served from the package (swagger-ui-py's
// dist) on this broker's OpenAPI document. No inline script (the page's Content-Security-Policy allows only this
// origin's scripts); no online validator badge (it would fetch from validator.swagger.io).
"use strict";

window.addEventListener("DOMContentLoaded", function () {
  const root = document.getElementById("swagger-ui");
  window.ui = SwaggerUIBundle({
    url: root.dataset.openapi,
    dom_id: "#swagger-ui",
    deepLinking: true,
    layout: "BaseLayout",
    presets: [SwaggerUIBundle.presets.apis],
    showExtensions: true,
    showCommonExtensions: true,
    validatorUrl: null,
  });
});
